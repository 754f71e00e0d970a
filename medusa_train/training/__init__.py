"""Training: loss targets, head-by-head losses, the shared loop, checkpoints, and the medusa1 / medusa2 recipes."""
