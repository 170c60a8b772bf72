"""The ``kvwire`` command and its terminal views."""
