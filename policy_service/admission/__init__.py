"""The admission table: its entries, files, publisher, catch-up archive and catch-up of jobs decided
from it."""
