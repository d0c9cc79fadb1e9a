"""Metadata records in a die's window, their doorbells, and the bounded waits on them."""
