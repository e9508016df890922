"""What this machine is: where Python runs (Colab, Kaggle, Jupyter, a script), and how
many cores a launch runs on, laid out how."""
