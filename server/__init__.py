"""tandem: the HTTP and ZeroMQ frontends and the command line."""
