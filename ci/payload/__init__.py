"""The payload's interface: its build profile, its command builder and where it lies, loaded once."""
