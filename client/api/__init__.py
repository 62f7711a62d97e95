"""The public face: Client, AsyncClient and the objects they return (contexts, buffers, streams, shares), pipelines."""
