"""The wire boundary: generated gRPC stubs, the one conversion module, the one error table.

- ``generated/``: protoc output for ``proto/asteria/v1/*.proto`` (checked in; regenerate with
  ``scripts/gen_proto.sh``, never edit by hand).
- ``convert``: the only code that turns protobuf messages into Asteria's Python values and back,
  including the chunking of arrays into byte streams.
- ``errors``: the one table between gRPC status codes and Asteria exceptions.

No gRPC or protobuf type leaves this package except through the servicers and the client's gRPC
transport, which are the two sides of the wire.
"""
