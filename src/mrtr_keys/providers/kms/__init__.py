"""AWS KMS envelope backend and its KMS client."""
