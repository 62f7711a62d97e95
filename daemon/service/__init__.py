"""The daemon as a service: assembly and life cycle, configuration, logs, metrics, systemd, security, CLI."""
