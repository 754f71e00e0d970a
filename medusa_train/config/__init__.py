"""Typed configuration of every command, one check helper, and where the shipped configs live."""
