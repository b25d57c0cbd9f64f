"""Reading committed steps back: the restore selection agreed by every host, the step
reader, lazy views, replicated leaves read once and exchanged, restore targets, and the
resume pre-flight.
"""
