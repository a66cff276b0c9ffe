"""The streaming top-k engines behind ``lik_cupy.retrieve`` and ``lik_cupy.Corpus``: the corpus as
checked parts (``parts``), their documents on the host or the device (``docs``), and the NumPy
(``cpu``) and GPU (``gpu``) engines that score them in bounded chunks into a running top-k."""
