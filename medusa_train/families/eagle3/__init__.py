"""EAGLE-3 drafts: one decoder layer on three of the backbone's hidden states, chained a token at a time."""
