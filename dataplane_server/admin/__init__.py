"""Operations surface of the service: gRPC admin endpoint and Prometheus metrics.

- ``servicer``: the AdminService RPCs (protobuf in, protobuf out; nothing unpickled).
- ``server``: the gRPC server around it: health, reflection, bearer-token auth, TLS, size limit.
- ``metrics``: a Prometheus collector that pulls stats from the actors on each scrape.
- ``actor``: ``AdminActor``, the Ray actor that runs both next to the controller.
- ``gen_proto``: regenerates ``dataplane_server/admin_pb`` from ``proto/``.
"""
