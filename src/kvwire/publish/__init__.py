"""The engine side: the publisher (intake + sender), its config and snapshot model."""
