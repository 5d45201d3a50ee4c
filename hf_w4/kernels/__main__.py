from .registry import support_matrix

print(support_matrix())
