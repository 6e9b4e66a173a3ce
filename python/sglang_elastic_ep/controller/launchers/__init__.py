"""Launchers start and stop joiner processes for the controller, behind ``base.Launcher``."""
