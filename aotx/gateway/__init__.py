"""The gateway process (``aotx gateway``): HTTP in front of the broker.

Bearer credentials, the standard and native routes, JSON/SSE rendering and UTF-8
decoding.  It holds no request state: every read, wait and cancel is a broker call
to the device.  It never imports :mod:`aotx.device` or :mod:`aotx.engine`; what it
shares with them is :mod:`aotx.wire`.
"""
