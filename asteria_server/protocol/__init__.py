"""The wire boundary: everything both sides of a connection must agree on, and nothing else.

- ``generated/``: protoc output for ``proto/asteria/v1/*.proto`` (checked in; regenerate with
  ``scripts/gen_proto.sh``, never edit by hand).
- ``convert``: the only code that turns protobuf messages into Asteria's Python values and back.
- ``framing``: how arrays follow their header on a stream (chunks, or a shared-memory reference).
- ``shm``: the shared-memory segment layout (header, seqlock word, snapshot and result layouts),
  its creation and its checks; used by the same-host transport and the engine's solver workers.
- ``handover``: the versioned sub-protocol of the ``<socket>.shm`` socket that hands segments over.
- ``errors``: the one table between gRPC status codes and Asteria exceptions.

No gRPC or protobuf type leaves this package except through the servicers and the client's gRPC
transport, which are the two sides of the wire. Nothing here imports the engine.
"""
