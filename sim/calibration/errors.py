"""The error every calibration fit raises on unusable input."""


class CalibrationError(ValueError):
    """Unusable step log or fit input; the message names the file and column."""
