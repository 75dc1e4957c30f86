"""The prolog/epilog hooks: their command lines, the spool of events not yet delivered and its replayer, the job environment."""
