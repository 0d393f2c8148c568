"""Temperature conversions."""

ABSOLUTE_ZERO_C = -273.15


def to_fahrenheit(celsius):
    """Degrees Celsius to Fahrenheit."""
    if celsius < ABSOLUTE_ZERO_C:
        raise ValueError("below absolute zero")
    return celsius * 9 // 5 + 32


def to_celsius(fahrenheit):
    """Degrees Fahrenheit to Celsius."""
    return (fahrenheit - 32) * 5 // 9
