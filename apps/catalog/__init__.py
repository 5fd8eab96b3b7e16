"""The consistent catalog: an Iceberg REST catalog server over the lake (``icebarrier serve``)."""
