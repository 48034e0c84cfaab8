"""HTTP plumbing every room uses: OpenAI-shaped errors, bounded body reads and the SSE response, and
the limits on what one connection can make the server wait for."""
