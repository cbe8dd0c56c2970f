"""The aotx broker wire protocol: a sans-I/O codec.

Every packet between the gateway, the broker and the device is at most ``MAX_PACKET``
(65536) bytes: a 128-byte little-endian header, then ``payload_length`` payload bytes.
The same header serves requests (gateway -> device) and replies; the fields an
operation's request does not use are zero (``check_request``).  Each fixed layout (the
header, the information head and rows, grant rows, media metadata, the policy status,
telemetry) is one table: a NamedTuple whose fields carry their rows (format, offset,
who fixed it, meaning); the ``struct``, the codec and the tables of docs/protocol.md
come from those rows.  The seed (``shared/seeds``) fixes the offsets marked so.

Nothing here does I/O.  Decoders take ``bytes``/``memoryview`` and return a value or
raise :class:`WireError`, whose status and :class:`Reason` are what to answer with.

The package reads in this order: ``enums`` (constants, enums, flags, reasons, the
error), ``table`` (a layout's rows), ``header`` (the header and the packet codec),
``waits``, ``submission`` (SUBMIT and EMBED payloads), ``info``, ``records`` (grants,
media, policy, telemetry).  Every name is re-exported here: ``wire.X`` is the way in.
What the device takes of a medium or a schema (its policy, not the format) is in
:mod:`aotx.config`.
"""

from .enums import *  # noqa: F403
from .header import *  # noqa: F403
from .info import *  # noqa: F403
from .records import *  # noqa: F403
from .submission import *  # noqa: F403
from .table import *  # noqa: F403
from .table import _View as _View  # the docs' table test reads the accessors
from .waits import *  # noqa: F403
