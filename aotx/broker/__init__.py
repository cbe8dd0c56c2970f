"""The broker process (``aotx broker``): ``service.sock`` <-> the mapped mailboxes.

Transport state only (which connection owns which mailbox); it validates packets
but never interprets requests, grants or results.
"""
