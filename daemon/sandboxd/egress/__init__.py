"""The egress proxy: one endpoint per sandbox, HTTP/CONNECT/SOCKS5, its DNS and its connection records."""
