"""Everything between the user's command and a running, correctly grouped process group."""
