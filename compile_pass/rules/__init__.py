"""One module per rule: match, check, replace."""
