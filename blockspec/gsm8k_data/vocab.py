"""Word lists for the demo problems: names with pronouns, countable items, containers, places.

Many names and items give the text variety that makes draft acceptance figures meaningful (a
draft cannot just memorise one sentence), while every word stays a single token of a small
vocabulary.
"""
from __future__ import annotations

# (name, subject pronoun, possessive pronoun)
PEOPLE: tuple[tuple[str, str, str], ...] = tuple(
    [(n, "she", "her") for n in (
        "Natalia", "Maria", "Emma", "Olivia", "Sophia", "Ava", "Mia", "Lily", "Grace", "Chloe",
        "Zoe", "Hannah", "Nora", "Aisha", "Priya", "Mei", "Yuki", "Fatima", "Elena", "Sara",
        "Julia", "Nina", "Rosa", "Amara", "Leah", "Ruby", "Alice", "Clara", "Ivy", "Jasmine")]
    + [(n, "he", "his") for n in (
        "James", "Liam", "Noah", "Ethan", "Lucas", "Mason", "Leo", "Omar", "Ravi", "Kenji",
        "Diego", "Mateo", "Samuel", "David", "Daniel", "Henry", "Jack", "Owen", "Ben", "Carlos",
        "Ahmed", "Tom", "Max", "Felix", "Hugo", "Ivan", "Marco", "Ali", "Paul", "Sam")])

# (singular, plural) of things people count
ITEMS: tuple[tuple[str, str], ...] = (
    ("apple", "apples"), ("pencil", "pencils"), ("sticker", "stickers"), ("cookie", "cookies"),
    ("marble", "marbles"), ("book", "books"), ("cupcake", "cupcakes"), ("flower", "flowers"),
    ("card", "cards"), ("shell", "shells"), ("balloon", "balloons"), ("egg", "eggs"),
    ("muffin", "muffins"), ("candle", "candles"), ("bead", "beads"), ("stamp", "stamps"),
    ("orange", "oranges"), ("banana", "bananas"), ("crayon", "crayons"), ("toy car", "toy cars"),
    ("cherry", "cherries"), ("peach", "peaches"), ("button", "buttons"), ("ribbon", "ribbons"),
    ("lemon", "lemons"), ("potato", "potatoes"), ("tomato", "tomatoes"), ("puzzle", "puzzles"),
    ("bracelet", "bracelets"), ("notebook", "notebooks"), ("carrot", "carrots"),
    ("strawberry", "strawberries"), ("sandwich", "sandwiches"), ("brownie", "brownies"),
    ("comic", "comics"), ("coin", "coins"),
)

# (singular, plural) of containers that hold items
CONTAINERS: tuple[tuple[str, str], ...] = (
    ("box", "boxes"), ("bag", "bags"), ("basket", "baskets"), ("pack", "packs"),
    ("jar", "jars"), ("crate", "crates"), ("tray", "trays"), ("bucket", "buckets"),
    ("carton", "cartons"), ("bundle", "bundles"),
)

# (singular, plural) of things bought for a price
GOODS: tuple[tuple[str, str], ...] = (
    ("shirt", "shirts"), ("hat", "hats"), ("notebook", "notebooks"), ("toy", "toys"),
    ("ticket", "tickets"), ("plant", "plants"), ("mug", "mugs"), ("lamp", "lamps"),
    ("scarf", "scarves"), ("backpack", "backpacks"), ("game", "games"), ("pillow", "pillows"),
    ("bottle of juice", "bottles of juice"), ("pair of socks", "pairs of socks"),
    ("sandwich", "sandwiches"), ("pizza", "pizzas"), ("cake", "cakes"), ("poster", "posters"),
)

DAYS: tuple[str, ...] = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday",
                         "Sunday")
PLACES: tuple[str, ...] = ("market", "bakery", "store", "fair", "mall", "school sale",
                           "book shop", "farm stand")
GROUPS: tuple[str, ...] = ("friends", "classmates", "cousins", "neighbors", "teammates")
ANIMALS: tuple[tuple[str, int], ...] = (("chickens", 2), ("ducks", 2), ("cows", 4),
                                        ("goats", 4), ("sheep", 4), ("horses", 4), ("pigs", 4))
