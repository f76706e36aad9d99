"""What keeps ranks in step and fails them together, shared by both backends: ranks that are
threads of one process (``threads``: rendezvous, agreement, mailboxes, split, ``AbortEvent``) and
the watchdog that bounds a blocking communicator's calls (``watchdog``). Imports ``base`` only."""
