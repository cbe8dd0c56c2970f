"""The device process (``aotx device``): the authority for grants, requests,
results, media sources and the resident policy.

It drives the models through :mod:`aotx.engine` and speaks :mod:`aotx.wire` over the
mailboxes; it never imports :mod:`aotx.gateway`.
"""
