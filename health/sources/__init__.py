"""Memory sources. Each returns its figures or says why it has none; none raises."""
