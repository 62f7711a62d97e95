"""What both the front and the device lanes apply to a request: framing, admission, observation."""
