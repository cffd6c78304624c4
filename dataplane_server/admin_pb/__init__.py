"""Generated from proto/dataplane/admin/v1/admin.proto; do not edit.

Regenerate with: python -m dataplane_server.admin.gen_proto
"""
