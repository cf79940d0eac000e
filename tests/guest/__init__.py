"""A tiny real guest for the runner tests: the distribution kernel and a busybox initramfs."""
