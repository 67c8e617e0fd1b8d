"""SGLang over HTTP: the client engine, the API field table and payload builders, the server/router launcher."""
