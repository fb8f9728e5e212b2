"""What llmctl is as software: its version and build, and the wheel the nodes install."""
