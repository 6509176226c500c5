"""One run: the builds measured, their records, the baselines written and read, and the flow that
measures what the pure gate (`gate.check`) asks for and calls it again (`flow`)."""
