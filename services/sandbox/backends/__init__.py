"""Sandbox backends: namespace (bubblewrap + overlayfs + cgroups), criu (runc + CRIU), firecracker."""
