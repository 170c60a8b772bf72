"""kvwire's exact streams on NATS JetStream (optional: ``pip install kvwire[nats]``).

See docs/scale-out.md. :mod:`.subjects` is the layout both sides share."""
