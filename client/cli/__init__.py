"""The cuctx command line: its commands, the doctor's checks, the tables it prints."""
