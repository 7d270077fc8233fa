"""Generated from proto/ by scripts/gen_proto.sh. Do not edit."""
