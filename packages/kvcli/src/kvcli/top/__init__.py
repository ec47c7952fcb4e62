"""`kvcli top`: a live Textual dashboard of one kvserver or a whole fleet."""
