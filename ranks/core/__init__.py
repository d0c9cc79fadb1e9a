"""Shared by every role: the rank's context, the start-up handshake, the messages between host and
dies, a die's I/O with its host."""
