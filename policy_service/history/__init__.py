"""The history store (SQLite or MariaDB), its schema, migrations, writer lease, decision journal,
and the [history] config and CLI."""
