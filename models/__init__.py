"""Model descriptions: what the networks compute, nothing about speed."""
