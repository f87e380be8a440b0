"""Test and benchmark support: a real OpenSSH sshd on 127.0.0.1 in front of the pct stand-in."""
