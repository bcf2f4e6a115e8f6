"""tandem: messages between processes and the all-reduce transports."""
