"""Logical sharding rules and meshes; several processes as one program."""
