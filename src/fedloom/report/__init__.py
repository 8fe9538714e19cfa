"""Tables and plots across runs."""
