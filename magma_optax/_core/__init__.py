"""The private core: helpers every concern shares; imports no other subpackage."""
