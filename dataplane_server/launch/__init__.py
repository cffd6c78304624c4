"""Starting a service: the local Ray, the actors, the factory, the process's signals."""
