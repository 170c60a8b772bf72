"""Engines that run without a GPU: the demo engine and (soon) the fleet simulator."""
