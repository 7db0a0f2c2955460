"""What is kept: the SQLite store, the hash-chained event log, the artifact store, the forensic index and retention."""
