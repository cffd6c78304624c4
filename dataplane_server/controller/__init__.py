"""The controller actor and its verb mixins: the Ray shell around the key space."""
